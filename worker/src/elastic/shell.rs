//! The control-plane shell of one worker: the membership machine ([`super::membership`]), the
//! coordinator calls that feed it, the background tasks (heartbeat, watch, commit reports) and
//! the effects it queues.
//!
//! [`super::ElasticGroup`] is this shell plus a data plane ([`super::DataPlane`]). What differs
//! between the worlds a worker runs in (production, the deterministic simulation, the scale
//! harness) sits behind two seams: the [`ControlClient`] (its connector: real TCP, or a
//! simulated network) and the [`World`] (whether the process may run, the random source, the
//! host relays' sockets, and what an observer such as the simulation's ledger hears). The clock is tokio's: the real
//! clock in production, the simulated one under a simulation that drives tokio's time.

use super::membership::{CallError, Effect, JoinNext, Membership, WatchNext};
use super::ElasticError;
use crate::control::{
    AbstractUnix, ControlClient, ControlConfig, ControlError, EventRelay, HostRelay, RelayEvents, RelayNet,
    FULL_AFTER_FAILURE, RESUBSCRIBE_WINDOW,
};
use crate::{CommError, RootCause};
use cohort_proto::ids::{JobId, WorkerId};
use cohort_proto::v1 as pb;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

/// The time now on tokio's clock (the real clock unless a simulation or a test drives it).
pub(super) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// What differs between the worlds a worker runs in, beside the coordinator client's
/// connector: whether the process may run now, where randomness comes from, where the host
/// relays' sockets live, and who observes the shell. [`RealWorld`] is production's.
pub trait World: Send + Sync + 'static {
    /// Waits while the process may not run (the simulation's SIGSTOP); `None`: it runs now.
    /// Every background task and every join attempt passes it before it acts.
    fn held(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> {
        None
    }

    /// 64 random bits (the watch's reopen jitter).
    fn entropy(&self) -> u64 {
        rand::random()
    }

    /// Where the host's heartbeat and event relays bind and connect their sockets (with
    /// [`super::ElasticConfig::heartbeat_relay`]): production's abstract Unix sockets.
    fn relay_net(&self) -> Arc<dyn RelayNet> {
        Arc::new(AbstractUnix)
    }

    /// Hears what the shell did: the simulation's ledger and trace. Called outside the
    /// machine's lock; it must not block.
    fn observe(&self, _seen: Observed<'_>) {}
}

/// Production's world: runs at once, the thread's random source, abstract Unix sockets for
/// the host relays, and the shell's own tracing events as the only observer.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealWorld;

impl World for RealWorld {}

/// What the shell did, as a [`World`] observes it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Observed<'a> {
    /// A join is about to be asked for.
    Joining,
    /// A join was refused.
    JoinRefused {
        /// Why.
        error: &'a (dyn std::error::Error + Send + Sync),
        /// How long this worker stays excluded, when that is why.
        excluded_for: Option<Duration>,
    },
    /// This worker joined as `incarnation`.
    Joined {
        /// The new incarnation.
        incarnation: u64,
    },
    /// The coordinator no longer knows this worker's incarnation (`rpc`'s NOT_FOUND).
    Evicted {
        /// The call whose answer said so.
        rpc: &'static str,
    },
    /// The job ended, as this worker heard it.
    JobEnded {
        /// `finished` or `failed`.
        outcome: &'a str,
        /// Why.
        reason: &'a str,
    },
    /// A revocation heard for the first time from the job's events.
    RevocationHeard {
        /// The revoked generation.
        generation: u64,
        /// Its root cause.
        cause: Option<&'a pb::RootCause>,
    },
    /// A rendezvous answered "waiting".
    Waiting(&'a pb::Waiting),
    /// A call failed (not a refusal the machine acts on).
    CallFailed {
        /// The call.
        rpc: &'static str,
        /// Its error.
        error: &'a (dyn std::error::Error + Send + Sync),
    },
    /// A call outlasted every bound its client sets ([`call_bound`]): the shell stopped
    /// waiting for it. Never expected; the simulation counts it as a violation.
    Overran {
        /// The call.
        rpc: &'static str,
        /// The bound it outlasted.
        bound: Duration,
    },
    /// A failure report was answered (`None`: it failed or was not answered in time).
    Reported(Option<&'a pb::FailureReportResponse>),
    /// An event of the job, from this worker's own watch stream or its host's event relay, as
    /// it is handed to the machine (an event can come twice: a stream's first messages are the
    /// state, which the relay may have handed on already).
    Event(&'a pb::JobEvent),
    /// One heartbeat was answered (`error` is `None`), or failed: not answered in time, or
    /// refused.
    Heartbeat {
        /// Why it failed.
        error: Option<&'a (dyn std::error::Error + Send + Sync)>,
    },
}

/// The longest one client call may take: its client's own bounds (request timeout, retry
/// budget, twice over, and `extra`: a long poll's wait) and a margin. The shell stops waiting
/// for a call past it ([`Observed::Overran`]).
pub fn call_bound(config: &ControlConfig, extra: Duration) -> Duration {
    config.request_timeout + extra + config.retry_budget + config.request_timeout + Duration::from_secs(5)
}

/// The gRPC client's errors, as the membership machine tells them apart: NOT_FOUND is the
/// coordinator saying it no longer knows the incarnation that called; the client's typed
/// refusals of a join (excluded, worker id in use) keep their time to come back.
impl From<ControlError> for CallError {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::Excluded { message, retry_after } => CallError::Excluded { message, retry_after },
            ControlError::IdInUse { message, retry_after } => CallError::IdInUse { message, retry_after },
            e if e.code() == Some(tonic::Code::NotFound) => CallError::NotMember(e),
            e => CallError::Failed(e),
        }
    }
}

/// The membership machine, shared with the background tasks, and what its effects act on.
/// Every decision is the machine's ([`Membership`]); the shell performs the calls it needs
/// and the [`Effect`]s it queues.
pub(super) struct Shared {
    machine: Mutex<Membership>,
    /// The current generation's number and what revokes its communicator ([`Effect::Abort`]).
    revoker: Mutex<Option<(u64, Revoke)>>,
    /// Woken on [`Effect::Wake`]: by revocations, the job's end and a new incarnation.
    pub(super) changed: Notify,
    /// Step times since the last heartbeat, sent with it.
    pub(super) timing: Mutex<super::StepTimes>,
    pub(super) world: Arc<dyn World>,
    /// [`call_bound`] without a long poll's wait.
    bound: Duration,
}

/// What revokes a generation's communicator.
pub(super) type Revoke = Arc<dyn Fn(RootCause) + Send + Sync>;

impl Shared {
    /// The shell of a worker that has not joined yet.
    pub(super) fn new(exclusion_wait: Duration, control: &ControlConfig, world: Arc<dyn World>) -> Self {
        Shared {
            machine: Mutex::new(Membership::new(exclusion_wait)),
            revoker: Mutex::new(None),
            changed: Notify::new(),
            timing: Mutex::new(super::StepTimes::default()),
            world,
            bound: call_bound(control, Duration::ZERO),
        }
    }

    /// Feeds one input to the machine (`rpc`: the call whose answer it is, or ""), then
    /// performs the effects it queued and tells the world what changed (outside the machine's
    /// lock: aborting a transport runs its abort hook).
    pub(super) fn drive<T>(&self, rpc: &'static str, input: impl FnOnce(&mut Membership) -> T) -> T {
        let (output, effects, evicted, ended) = {
            let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
            let (was_evicted, had_ended) = (machine.is_evicted(), machine.ended().is_some());
            let output = input(&mut machine);
            let effects: Vec<Effect> = std::iter::from_fn(|| machine.poll_effect()).collect();
            let ended = if had_ended { None } else { machine.ended() };
            (output, effects, !was_evicted && machine.is_evicted(), ended)
        };
        if evicted {
            self.world.observe(Observed::Evicted { rpc });
        }
        if let Some(ElasticError::JobEnded { outcome, reason }) = &ended {
            self.world.observe(Observed::JobEnded { outcome, reason });
        }
        for effect in effects {
            match effect {
                Effect::Abort { generation, cause } => {
                    let current = self.revoker.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    if let Some((g, revoke)) = current {
                        if g == generation {
                            revoke(cause);
                        }
                    }
                }
                Effect::Wake => self.changed.notify_waiters(),
            }
        }
        output
    }

    /// Reads the machine's state.
    pub(super) fn read<T>(&self, query: impl FnOnce(&Membership) -> T) -> T {
        query(&self.machine.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Installs what revokes generation `number`'s communicator, then tells the machine the
    /// generation connected (the revoker first, so that a revocation heard meanwhile finds it).
    pub(super) fn connected(&self, number: u64, revoke: Revoke) {
        *self.revoker.lock().unwrap_or_else(|e| e.into_inner()) = Some((number, revoke));
        self.drive("", |m| m.handle_connected(number));
    }

    /// One event of the job's stream, applied whole; a revocation heard for the first time is
    /// observed.
    fn event(&self, event: pb::JobEvent) {
        if let Some(pb::job_event::Event::GenerationRevoked(r)) = &event.event {
            if self.read(|m| m.cause_of(r.generation)).is_none() {
                self.world.observe(Observed::RevocationHeard { generation: r.generation, cause: r.cause.as_ref() });
            }
        }
        self.world.observe(Observed::Event(&event));
        self.drive("Watch", |m| m.handle_event(event));
    }

    /// Waits while the world holds the process.
    pub(super) async fn runnable(&self) {
        if let Some(held) = self.world.held() {
            held.await;
        }
    }

    /// Runs one coordinator call under [`call_bound`] (`extra`: its long poll's wait); past it,
    /// the shell stops waiting ([`Observed::Overran`]). The error, as the machine classifies it;
    /// a failure that the machine does not act on is observed.
    ///
    /// # Cancel safety
    /// As cancel safe as `call`.
    pub(super) async fn call<T>(
        &self,
        rpc: &'static str,
        extra: Duration,
        call: impl Future<Output = Result<T, ControlError>>,
    ) -> Result<T, CallError> {
        let bound = self.bound + extra;
        let result = match tokio::time::timeout(bound, call).await {
            Ok(result) => result.map_err(CallError::from),
            Err(_) => {
                warn!(rpc, ?bound, "a coordinator call outlasted every bound of its client; given up");
                self.world.observe(Observed::Overran { rpc, bound });
                Err(CallError::Failed(ControlError::Unreachable {
                    endpoints: String::new(),
                    attempts: 0,
                    last: format!("no answer within {bound:?}"),
                }))
            }
        };
        if let Err(error @ CallError::Failed(_)) = &result {
            self.world.observe(Observed::CallFailed { rpc, error });
        }
        result
    }
}

/// Joins: a new incarnation, whose heartbeat the caller then starts. An excluded worker (its
/// failures repeated) waits out its exclusion, as long as the coordinator says it has left,
/// and asks again: in all at most the machine's exclusion wait, after which it fails with
/// [`ElasticError::Excluded`]. Answers the incarnation, the heartbeat interval and the lease.
///
/// # Cancel safety
/// Cancel safe: a join left half done expires with its lease.
pub(super) async fn join(
    client: &ControlClient,
    shared: &Shared,
    request: pb::JoinRequest,
) -> Result<(u64, Duration, Duration), ElasticError> {
    shared.drive("", |m| m.begin_join(now()));
    loop {
        shared.runnable().await;
        shared.world.observe(Observed::Joining);
        let answer = shared.call("Join", Duration::ZERO, client.join(request.clone())).await;
        if let Err(error) = &answer {
            let excluded_for = match error {
                CallError::Excluded { retry_after, .. } => Some(*retry_after),
                _ => None,
            };
            shared.world.observe(Observed::JoinRefused { error, excluded_for });
        }
        match shared.drive("Join", |m| m.handle_join(now(), answer))? {
            JoinNext::Joined { incarnation, heartbeat_interval, lease_ttl } => {
                shared.world.observe(Observed::Joined { incarnation });
                return Ok((incarnation, heartbeat_interval, lease_ttl));
            }
            JoinNext::RetryAt(at) => tokio::time::sleep_until(at.into()).await,
        }
    }
}

/// Keeps the membership's lease alive and reports progress, until a newer incarnation
/// takes over or the coordinator no longer knows this one: through the host's heartbeat
/// relay when there is one, else directly.
///
/// # Cancel safety
/// Cancel safe: a beat cut short is a beat missed.
pub(super) async fn heartbeat_task(
    client: ControlClient,
    relay: Option<HostRelay>,
    shared: Arc<Shared>,
    job: JobId,
    worker_id: WorkerId,
    incarnation: u64,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        shared.runnable().await;
        let Some(progress) = shared.read(|m| m.heartbeat_request(incarnation)) else { return };
        let timing = shared.timing.lock().unwrap_or_else(|e| e.into_inner()).take();
        let request = pb::HeartbeatRequest {
            job: job.to_string(),
            worker_id: worker_id.to_string(),
            incarnation,
            generation: progress.generation,
            step: progress.step,
            // A rank waiting on a late peer says so (the coordinator's status shows it).
            activity: match cohort_transports::activity::waiting_on_late(job.as_str(), progress.generation) {
                Some(late) => format!("{}; {late}", progress.activity),
                None => progress.activity,
            },
            deadlines: progress.deadlines,
            timing,
        };
        let answer = match &relay {
            Some(relay) => shared.call("Heartbeat", Duration::ZERO, relay.heartbeat(request)).await,
            None => shared.call("Heartbeat", Duration::ZERO, client.heartbeat(request)).await,
        };
        shared.world.observe(Observed::Heartbeat { error: answer.as_ref().err().map(|e| e as _) });
        if !shared.drive("Heartbeat", |m| m.handle_heartbeat(incarnation, answer)) {
            return;
        }
    }
}

/// Sends commit reports: whenever a newer one is recorded, sends the newest, and hands the
/// answer to the machine.
///
/// # Cancel safety
/// Cancel safe: a report cut short is superseded by the next one.
pub(super) async fn commit_task(
    client: ControlClient,
    shared: Arc<Shared>,
    mut commits: tokio::sync::watch::Receiver<Option<pb::CommitRequest>>,
) {
    while commits.changed().await.is_ok() {
        let Some(request) = commits.borrow_and_update().clone() else { continue };
        let (generation, incarnation) = (request.generation, request.incarnation);
        let answer = shared.call("Commit", Duration::ZERO, client.commit(request)).await;
        shared.drive("Commit", |m| m.handle_commit(generation, incarnation, answer));
    }
}

/// Follows the job's events and hands them to the machine: from the host's event relay (with
/// a quiet stream of this worker's own) or, without a relay, from a full stream of its own.
/// The stream is reopened when it breaks (after the machine's backoff) and when this worker
/// joins again as a new incarnation. The worker's own open stream is also how the coordinator
/// knows this process is alive: when the process dies, the stream's connection closes and
/// the rendezvous stops waiting for it (before its lease lapses), so the stream is always
/// opened for the current incarnation, and losing the relay does not close it.
///
/// # Cancel safety
/// Cancel safe: events are applied whole; a reopened stream or subscription starts with the
/// current state.
pub(super) async fn watch_task(
    client: ControlClient,
    shared: Arc<Shared>,
    job: JobId,
    worker_id: WorkerId,
    relay: Option<EventRelay>,
) {
    let mut relay = RelayPath::new(relay);
    loop {
        // Register for the wake-up before reading the incarnation, so that a join in
        // between is not missed.
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let incarnation = shared.read(Membership::incarnation);
        // Subscribed before the stream opens: the stream's state and the relay's together
        // cover every event (each is applied once; repeats change nothing).
        let mut events = relay.subscribe();
        let watch_request = |quiet| pb::WatchRequest {
            job: job.to_string(),
            worker_id: worker_id.to_string(),
            incarnation,
            compact: true,
            quiet,
        };
        match shared.call("Watch", Duration::ZERO, client.watch(watch_request(events.is_some()))).await {
            Ok(mut stream) => {
                shared.drive("Watch", Membership::handle_watch_opened);
                loop {
                    // Watching alone after the relay failed: when that spell ends, back to it.
                    let retry = if events.is_none() { relay.retry_at() } else { None };
                    tokio::select! {
                        message = stream.message() => match message {
                            Ok(Some(event)) => {
                                // A held process reads nothing: the event waits for it.
                                shared.runnable().await;
                                shared.event(event)
                            }
                            Ok(None) => break,
                            Err(status) => {
                                debug!(%status, "watch stream broke; reopening");
                                break;
                            }
                        },
                        event = next_relayed(&mut events) => match event {
                            Ok(Some(event)) => {
                                relay.heard();
                                shared.runnable().await;
                                shared.event(event)
                            }
                            lost => {
                                // The relay's process ended (or dropped this subscriber): the
                                // stream stays open while the next relay is found or served.
                                events = relay.lost(lost.err());
                                if events.is_none() {
                                    // Watching alone: a full stream of its own, opened before
                                    // the quiet one closes (its first messages are the state,
                                    // what the relay did not hand on). Closing first would tell
                                    // a rendezvous that this live process died.
                                    match shared.call("Watch", Duration::ZERO, client.watch(watch_request(false))).await {
                                        Ok(mut full) => {
                                            if !recorded(&shared, &mut full).await {
                                                debug!("the full watch ended at once; reopening");
                                                break;
                                            }
                                            stream = full;
                                            shared.drive("Watch", Membership::handle_watch_opened);
                                        }
                                        Err(e) => {
                                            debug!(error = %e, "could not open a full watch; reopening");
                                            break;
                                        }
                                    }
                                }
                            }
                        },
                        _ = sleep_until_some(retry) => {
                            events = relay.subscribe();
                            if events.is_some() {
                                // Back to the relay: a quiet stream, opened before the full one
                                // closes (as above, the other way).
                                match shared.call("Watch", Duration::ZERO, client.watch(watch_request(true))).await {
                                    Ok(mut quiet) => {
                                        if !recorded(&shared, &mut quiet).await {
                                            debug!("the quiet watch ended at once; reopening");
                                            break;
                                        }
                                        stream = quiet;
                                        shared.drive("Watch", Membership::handle_watch_opened);
                                        debug!("watching through the host's event relay again");
                                    }
                                    Err(e) => {
                                        debug!(error = %e, "could not open a quiet watch; reopening");
                                        break;
                                    }
                                }
                            }
                        },
                        _ = changed.as_mut() => {
                            changed.set(shared.changed.notified());
                            changed.as_mut().enable();
                            if shared.read(|m| m.watch_is_stale(incarnation)) {
                                debug!(old = incarnation, "joined again; reopening the watch for the new incarnation");
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => debug!(error = %e, "watch failed; retrying"),
        }
        let entropy = shared.world.entropy();
        match shared.drive("Watch", |m| m.handle_watch_lost(incarnation, now(), entropy)) {
            WatchNext::Stop => return,
            WatchNext::ReopenAt(at) => tokio::time::sleep_until(at.into()).await,
        }
    }
}

/// Waits for the first message of a stream that replaces this worker's open one, and hands it
/// to the machine: the coordinator sends it once it has recorded the stream as this process's
/// control stream, and only then may the old one close (closing it first would record the
/// process as gone for a moment, and a rendezvous deciding then would leave it out). `false`:
/// the new stream ended or broke first. Past [`RECORD_WAIT`] (a store that slow), the old
/// stream closes all the same.
///
/// # Cancel safety
/// Cancel safe: a message read is handed on before it returns.
async fn recorded(shared: &Shared, stream: &mut tonic::Streaming<pb::JobEvent>) -> bool {
    match tokio::time::timeout(RECORD_WAIT, stream.message()).await {
        Ok(Ok(Some(event))) => {
            shared.runnable().await;
            shared.event(event);
            true
        }
        Ok(Ok(None) | Err(_)) => false,
        Err(_) => {
            debug!(wait = ?RECORD_WAIT, "the new watch's first message is late; switching to it all the same");
            true
        }
    }
}

/// How long a worker waits for a replacement watch stream's first message before it closes
/// the stream it replaces ([`recorded`]).
const RECORD_WAIT: Duration = Duration::from_secs(2);

/// The next event from the relay; pending for ever without a subscription.
///
/// # Cancel safety
/// Cancel safe ([`RelayEvents::next`] is).
async fn next_relayed(events: &mut Option<RelayEvents>) -> std::io::Result<Option<pb::JobEvent>> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; pending for ever without one.
///
/// # Cancel safety
/// Cancel safe: it only waits.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Losses of the relay within [`RESUBSCRIBE_WINDOW`] after which a worker watches alone.
const QUICK_LOSSES: usize = 3;

/// Longest a worker watches alone before it tries its host's event relay again.
const ALONE_AT_MOST: Duration = Duration::from_secs(300);

/// A worker's use of its host's event relay: subscribed while it serves, else a full stream of
/// the worker's own for [`FULL_AFTER_FAILURE`], twice as long after each failure in a row (up
/// to [`ALONE_AT_MOST`]).
struct RelayPath {
    relay: Option<EventRelay>,
    /// When the relay was lost lately (within [`RESUBSCRIBE_WINDOW`] of each other).
    losses: Vec<Instant>,
    /// Until when this worker watches alone.
    alone_until: Option<Instant>,
    /// How long the next failure makes it watch alone.
    alone_for: Duration,
}

impl RelayPath {
    fn new(relay: Option<EventRelay>) -> Self {
        Self { relay, losses: Vec::new(), alone_until: None, alone_for: FULL_AFTER_FAILURE }
    }

    /// An event came through the relay: it serves.
    fn heard(&mut self) {
        self.alone_for = FULL_AFTER_FAILURE;
    }

    /// When a worker watching alone tries the relay again (`None`: there is no relay).
    fn retry_at(&self) -> Option<Instant> {
        self.relay.as_ref()?;
        Some(self.alone_until.unwrap_or_else(now))
    }

    /// A subscription to the relay, unless there is none or it failed this worker lately.
    fn subscribe(&mut self) -> Option<RelayEvents> {
        let relay = self.relay.as_ref()?;
        if self.alone_until.is_some_and(|until| now() < until) {
            return None;
        }
        match relay.subscribe() {
            Ok(events) => Some(events),
            Err(e) => {
                self.give_up(&e.to_string(), true);
                None
            }
        }
    }

    /// The subscription ended (`error`, or a clean close): subscribes again at once, unless
    /// the relay hangs (it wrote nothing for [`crate::control::SILENCE_LIMIT`]) or was lost
    /// already within [`RESUBSCRIBE_WINDOW`].
    fn lost(&mut self, error: Option<std::io::Error>) -> Option<RelayEvents> {
        if let Some(e) = error.as_ref().filter(|e| e.kind() == std::io::ErrorKind::TimedOut) {
            self.give_up(&e.to_string(), true);
            return None;
        }
        let now = now();
        self.losses.retain(|at| now.duration_since(*at) < RESUBSCRIBE_WINDOW);
        self.losses.push(now);
        let why = error.map_or_else(|| "the relay closed the subscription".to_string(), |e| e.to_string());
        // A dying relay's socket can still take a connection (the kernel closes a killed
        // process's sockets one by one), which it then resets: a second loss at once is no
        // sign of trouble, a third within the window is (or a job's end, as the host's workers
        // exit one after another).
        if self.losses.len() >= QUICK_LOSSES {
            self.losses.clear();
            self.give_up(&format!("lost {QUICK_LOSSES} times within {RESUBSCRIBE_WINDOW:?}: {why}"), false);
            return None;
        }
        debug!(%why, "event relay lost; subscribing again");
        self.subscribe()
    }

    /// Watches alone for a while; `warn`: the relay hangs or cannot be reached (else it
    /// closed again and again, as at a job's end, and this is logged at `info`).
    fn give_up(&mut self, why: &str, warn: bool) {
        let relay = self.relay.as_ref().map_or("", EventRelay::socket_name);
        let alone_for = self.alone_for;
        if warn {
            warn!(%relay, %why, ?alone_for, "event relay failed; watching with a stream of this worker's own");
        } else {
            info!(%relay, %why, ?alone_for, "event relay closed again; watching with a stream of this worker's own");
        }
        self.alone_until = Some(now() + self.alone_for);
        self.alone_for = (self.alone_for * 2).min(ALONE_AT_MOST);
    }
}

/// Resolves once `generation` is revoked (with its cause) or the job has ended.
///
/// # Cancel safety
/// Cancel safe: it only waits.
pub(super) async fn revoked_or_ended(shared: &Shared, generation: u64) -> RootCause {
    loop {
        // Register for the wake-up before looking, so that a revocation in between is seen.
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(cause) = shared.read(|m| m.stop_reason(generation)) {
            return cause;
        }
        notified.await;
    }
}

/// Reports failed collectives of one worker's generations and answers their root cause.
/// Obtained from [`super::ElasticGroup::reporter`]; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct FailureReporter {
    pub(super) client: ControlClient,
    pub(super) shared: Arc<Shared>,
    pub(super) job: JobId,
    pub(super) worker_id: WorkerId,
    pub(super) root_cause_wait: Duration,
}

impl std::fmt::Debug for FailureReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureReporter")
            .field("job", &self.job.as_str())
            .field("worker_id", &self.worker_id.as_str())
            .finish()
    }
}

impl FailureReporter {
    /// The worker's current incarnation (changes when it had to join again).
    pub fn incarnation(&self) -> u64 {
        self.shared.read(Membership::incarnation)
    }

    /// Whether the watch has announced joiners waiting for a re-formation.
    pub fn reformation_pending(&self) -> bool {
        self.shared.read(Membership::reformation_pending)
    }

    /// Resolves once `generation` is revoked, with its root cause (or once the job has ended,
    /// with why): for code that watches a data plane cohort does not drive (a torch backend
    /// beneath a process group whose membership is cohort's), to abort its work.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits.
    pub async fn revoked(&self, generation: u64) -> RootCause {
        revoked_or_ended(&self.shared, generation).await
    }

    /// Turns a failed collective of `generation` into the generation's root cause.
    ///
    /// A revoked communicator already carries the cause. For a local detection (peer closed,
    /// timeout, protocol error) this reports the failure to the coordinator, which keeps the
    /// first report of the generation: the answer is the root cause every rank shares.
    ///
    /// # Cancel safety
    /// Cancel safe (reports are idempotent).
    pub async fn on_failure(&self, generation: u64, error: &CommError) -> RootCause {
        if let CommError::Revoked { cause, .. } = error {
            return cause.clone();
        }
        if let Some(cause) = self.shared.read(|m| m.cause_of(generation)) {
            return cause;
        }
        let failed_rank = match error {
            CommError::PeerFailed { rank, .. } => Some(*rank),
            CommError::Timeout { rank, .. } => *rank,
            _ => None,
        };
        let report = pb::FailureReport {
            job: self.job.to_string(),
            worker_id: self.worker_id.to_string(),
            incarnation: self.incarnation(),
            generation,
            failed_rank,
            reason: error.failure_reason(),
            kind: match error {
                CommError::PeerFailed { .. } => pb::failure_report::FailureKind::PeerClosed,
                CommError::Timeout { .. } => pb::failure_report::FailureKind::Timeout,
                _ => pb::failure_report::FailureKind::Unspecified,
            } as i32,
            progress: match error {
                CommError::Timeout { progress: Some(p), .. } => {
                    Some(pb::OpProgress { seq: p.seq, received: p.received })
                }
                _ => None,
            },
        };
        let answer = match tokio::time::timeout(
            self.root_cause_wait.max(Duration::from_secs(2)),
            self.client.report_failure(report),
        )
        .await
        {
            Ok(Ok(response)) => Some(response),
            Ok(Err(e)) => {
                warn!(error = %e, "could not report the failure; using the local error as the cause");
                None
            }
            Err(_) => {
                warn!("no answer to the failure report in time; using the local error as the cause");
                None
            }
        };
        self.shared.world.observe(Observed::Reported(answer.as_ref()));
        // Without the coordinator's record, the local error is the cause; revoking with it
        // closes the generation's links (which stayed open for the report) so that peers stop
        // waiting on this rank.
        let local = RootCause {
            rank: failed_rank,
            worker_id: String::new(),
            host: String::new(),
            reason: error.failure_reason(),
        };
        self.shared.drive("ReportFailure", |m| m.handle_report(generation, answer, local))
    }
}

#[cfg(test)]
mod tests {
    use super::{CallError, ControlError};
    use std::time::Duration;

    /// The gRPC shell's classification of the client's errors for the membership machine.
    #[test]
    fn control_errors_are_classified_for_the_membership_machine() {
        let rejected = |code| ControlError::Rejected { rpc: "Heartbeat", code, message: format!("{code:?}") };
        assert!(matches!(CallError::from(rejected(tonic::Code::NotFound)), CallError::NotMember(_)));
        for code in [tonic::Code::Unavailable, tonic::Code::FailedPrecondition, tonic::Code::PermissionDenied] {
            assert!(matches!(CallError::from(rejected(code)), CallError::Failed(_)), "{code:?}");
        }
        let unreachable = ControlError::Unreachable { endpoints: "x".into(), attempts: 3, last: "refused".into() };
        assert!(matches!(CallError::from(unreachable), CallError::Failed(ControlError::Unreachable { .. })));
        let left = Duration::from_millis(2500);
        let excluded = ControlError::Excluded { message: "failed 3 times".into(), retry_after: left };
        assert!(matches!(CallError::from(excluded), CallError::Excluded { retry_after, .. } if retry_after == left));
        let in_use = ControlError::IdInUse { message: "held".into(), retry_after: left };
        assert!(matches!(CallError::from(in_use), CallError::IdInUse { retry_after, .. } if retry_after == left));
    }
}
